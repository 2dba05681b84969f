"""`python -m miles_sync.sizing ...`: the sync sizing CLI."""

from miles_sync.sizing.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
