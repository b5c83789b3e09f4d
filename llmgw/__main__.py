from llmgw.cli.main import main

raise SystemExit(main())
