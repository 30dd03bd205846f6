"""`python -m starshard <command>`: the `starshard` console script without installing it."""
from starshard.commands.main import main

if __name__ == "__main__":
    main()
