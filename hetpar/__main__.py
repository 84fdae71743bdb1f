from hetpar.cli import run

run()
