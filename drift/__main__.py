from drift.cli import main

main(prog_name="drift")
