"""`python -m llama.demo`: the same as `llama demo`, which writes a small random-weight checkpoint."""

from llama.cli.demo import main

if __name__ == "__main__":
    main()
