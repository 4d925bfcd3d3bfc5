"""`python -m llama`: the same as the installed `llama` command."""

try:
    from llama.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the command's modules import: the one line and status it gives later
    import sys

    print("\nInterrupted (Ctrl-C)", file=sys.stderr)
    raise SystemExit(130) from None

if __name__ == "__main__":
    main()
