from dilococtl.cli import main

main()
