from sidecar.tools.cli import main

raise SystemExit(main())
