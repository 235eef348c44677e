from hetpilot.cli import main

raise SystemExit(main())
