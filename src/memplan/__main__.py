from memplan.cli.commands import main

main()
