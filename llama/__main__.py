"""`python -m llama`: the same as the installed `llama` command."""

from llama.commands import main

if __name__ == "__main__":
    main()
