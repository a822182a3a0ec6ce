from meshspeed.cli import main

raise SystemExit(main())
