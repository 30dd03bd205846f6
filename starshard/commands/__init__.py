"""The `starshard` program's commands (`starshard run | plan | serve | eval | bench | convert | ...`, main.py).
Each module here is one command's flags and its main(argv); launch/*.py are thin scripts around them so
torchrun and srun, which start a file, run the same code."""
