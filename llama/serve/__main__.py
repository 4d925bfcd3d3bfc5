"""`python -m llama.serve`: the same as `llama serve`."""

from llama.serve.main import main

if __name__ == "__main__":
    main()
