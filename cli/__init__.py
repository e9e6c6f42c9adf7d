"""The `rft` command line (cli/main.py) and what it shows on the terminal."""
