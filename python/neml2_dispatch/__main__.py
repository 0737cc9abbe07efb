"""python -m neml2_dispatch --cmake-prefix | --version | --program"""

import argparse
import sys

import neml2_dispatch


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m neml2_dispatch",
        description="Where the installed neml2-dispatch C++ package and program are.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--cmake-prefix", action="store_true",
                       help="the prefix for find_package(neml2_dispatch): pass it as "
                            "-DCMAKE_PREFIX_PATH=...")
    group.add_argument("--program", action="store_true",
                       help="the path of the neml2-dispatch program")
    group.add_argument("--version", action="store_true", help="the library's version")
    args = parser.parse_args(argv)
    try:
        if args.cmake_prefix:
            print(neml2_dispatch.cmake_prefix())
        elif args.program:
            print(neml2_dispatch.program())
        else:
            print(neml2_dispatch.__version__)
    except FileNotFoundError as e:
        print(f"python -m neml2_dispatch: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
