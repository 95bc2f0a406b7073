from trainer.entry import main

raise SystemExit(main())
