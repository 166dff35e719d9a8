from sidecar.fakeengine.cli import main

raise SystemExit(main())
