"""Strings of the launch config that reach a shell script or a scheduler: what each may hold.

The Slurm launcher renders an sbatch script (infra/launchers/slurm.py): `#SBATCH --key=value`
lines that sbatch parses, then shell lines. A newline in `launch.slurm.partition` used to end its
`#SBATCH` line and start a shell line of the script; an unquoted `launch.module` was pasted into
the `srun` command. So the recipe refuses, when it loads and naming the field (never echoing the
value):

- `ShellWord` (partition, account, qos, time, mem, job_name, executables and paths): letters,
  digits and `_ . , : / @ % + = -` only: no blank, quote, `$`, `;`, `|`, `&`, `~`, glob or
  control character. The template still quotes them (`shlex.quote`), so a rule relaxed later
  does not reopen the script.
- `ModuleName` (`launch.module`): a dotted Python module name.
- `EnvName` (keys of `launch.env`): a shell variable name (the script writes `export KEY=...`).
- `OneLine` (`launch.slurm.setup` lines, values of `sbatch_args` and `launch.env`, which are
  shell or Slurm syntax by design): no control character, so each stays the one line it reads as.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

_SHELL_WORD = re.compile(r"[A-Za-z0-9_.,:/@%+=-]+")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def shell_word(value: str) -> str:
    if not _SHELL_WORD.fullmatch(value):
        raise ValueError(
            "must be one shell word: letters, digits and _ . , : / @ % + = - only (no blank, quote, "
            "control or shell metacharacter)"
        )
    return value


def module_name(value: str) -> str:
    if not _MODULE.fullmatch(value):
        raise ValueError("must be a dotted Python module name (e.g. trainers.pretrain)")
    return value


def env_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
        raise ValueError("environment variable names are letters, digits and _, not starting with a digit")
    return value


def one_line(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("must not hold control characters (newline, carriage return, escape, ...)")
    return value


ShellWord = Annotated[str, AfterValidator(shell_word)]
ModuleName = Annotated[str, AfterValidator(module_name)]
EnvName = Annotated[str, AfterValidator(env_name)]
OneLine = Annotated[str, AfterValidator(one_line)]
