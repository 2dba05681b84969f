"""`python -m miles_sync.parity ...`: the export parity CLI."""

from miles_sync.parity.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
