from fakeengine.cli import main

raise SystemExit(main())
