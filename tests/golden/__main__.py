"""`make golden`: run every golden case and write tests/golden/*.json again (python -m tests.golden [AREA ...]).

The cases live in the test modules beside the tests that check them; this imports those modules (the ones that
declare a case), runs each case as the test does, and rewrites each area's file whole. With AREA names only those
files are written. It prints the files whose bytes changed: review them with `git diff tests/golden`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__.splitlines()[0])
    parser.add_argument("areas", nargs="*", help="only these areas' files (default: every area)")
    args = parser.parse_args(argv)
    # The test modules import their neighbours (factories, golden) as pytest lets them: from tests/ on the path.
    sys.path.insert(0, str(TESTS))
    import golden
    from golden.modules import case_modules, import_cases

    import_cases(case_modules())
    known = sorted({area for area, _ in golden.CASES})
    unknown = sorted(set(args.areas) - set(known))
    if unknown:
        parser.error(f"no golden area {', '.join(unknown)} (areas: {', '.join(known)})")
    chosen = [c for (area, _), c in sorted(golden.CASES.items()) if not args.areas or area in args.areas]
    with contextlib.redirect_stdout(io.StringIO()):  # the studies' tables: the files are the output here
        figures = golden.generate(chosen)
    changed = golden.write(figures)
    if not args.areas:  # a file whose area no case declares any more
        for stale in sorted(set(golden.DIR.glob("*.json")) - {golden.path_of(a) for a in known}):
            stale.unlink()
            changed.append(stale)
    for path in changed:
        print(f"[golden] wrote {path.relative_to(TESTS.parent)}")
    print(f"[golden] {len(chosen)} cases, {len(changed)} files changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
