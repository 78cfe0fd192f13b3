"""`python -m chaos`: the chaos suite (see chaos.run)."""

from chaos.run import main

if __name__ == "__main__":
    raise SystemExit(main())
