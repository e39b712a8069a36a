from curvkit.cli import main

raise SystemExit(main())
