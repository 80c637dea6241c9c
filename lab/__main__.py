"""python -m lab eval ARGS / python -m lab export ARGS: eval.py and commands/export.py on the lab's tiny
backbone and synthetic-* sets. Neither of them imports the lab (the layers run one way: the lab sits above
them); this entry point imports it, which registers the tiny backbone with open_clip and the synthetic sets
with eval, and then runs the command with the lab's world (lab.WORLD) as its `world` argument. The method
files load the lab themselves (--demo, --backbone tiny).

    python -m lab eval --backbone tiny --tasks synthetic --analyses geometry,ece
    python -m lab export --backbone tiny --pretrained runs/x/model.pt --out exported/tiny
"""
import importlib
import sys

import lab  # registers the tiny backbone and the synthetic sets; lab.COMMANDS: the scripts it runs


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in lab.COMMANDS:
        sys.exit(f"usage: python -m lab {{{','.join(lab.COMMANDS)}}} ARGS (got {argv[:1] or 'nothing'})")
    module = importlib.import_module(lab.COMMANDS[argv[0]].removesuffix(".py").replace("/", "."))
    from plumbing.cli import cli
    sys.argv = [f"python -m lab {argv[0]}", *argv[1:]]
    cli(lambda args: module.main(args, world=lab.WORLD), argv[1:])


if __name__ == "__main__":
    main()
