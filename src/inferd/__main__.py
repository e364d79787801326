import sys

from inferd.cli import main

if __name__ == "__main__":  # a spawned engine process re-imports the main module: it must not run the CLI
    sys.exit(main())
