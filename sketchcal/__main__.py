from sketchcal.cli import main

main()
