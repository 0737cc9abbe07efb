"""The ``neml2-dispatch`` console script: runs the program the wheel installed, with the
environment's torch libraries on its search path (found without importing torch)."""

import importlib.util
import os
import sys


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    program = os.path.join(here, "bin", "neml2-dispatch")
    if not os.path.isfile(program):
        print(f"neml2-dispatch: no program at {program} (install the wheel: pip install ./python)",
              file=sys.stderr)
        return 1
    env = dict(os.environ)
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        torch_lib = os.path.join(list(spec.submodule_search_locations)[0], "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (torch_lib, env.get("LD_LIBRARY_PATH", "")) if p)
    # --plot draws with this python (matplotlib), as the program looks for it first.
    env.setdefault("NEML2_DISPATCH_PYTHON", sys.executable)
    os.execve(program, [program, *sys.argv[1:]], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
