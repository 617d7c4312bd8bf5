"""User-facing errors: one line that names the problem and the fix; the CLI and the emitted
program exit with code 2."""

import sys


class AutoshardError(Exception):
    """Bad input or an impossible request. The message is shown to the user as is."""


class ProgramError(SystemExit):
    """The emitted program's one-line error for the person running it; exits with code 2."""

    def __init__(self, message: str):
        print(f"train.py: error: {message}", file=sys.stderr)
        super().__init__(2)


def check_output_file(path, flag: str = "-o") -> None:
    """Before any work: ``path`` can be written as a file (its parent made if missing), or a
    one-line error names why. A probe file beside it is written and removed."""
    import os
    from pathlib import Path

    path = Path(path)
    if path.is_dir():
        raise AutoshardError(f"{flag} {path} is a directory; give a file name in it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.{os.getpid()}.probe")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise AutoshardError(f"{flag} {path}: cannot write there ({e.strerror or e}); give a writable path") from None
