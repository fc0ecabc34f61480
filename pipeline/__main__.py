import sys

from pipeline.cli.main import main

if __name__ == "__main__":  # not when a spawned process (the bench's load stream) imports it
    sys.exit(main())
