"""Optional dependencies (pyproject extras): a clear error when one is missing.

* `plots`       — matplotlib, for the figures of `disagmoe plan --plot`,
                  `disagmoe bench --plots` and benchmarks/ (not for training);
* `tensorboard` — TensorBoard event files of `disagmoe train --tensorboard`.

`pip install -e .` trains without either; `pip install -e '.[dev]'` has both.
"""

from __future__ import annotations

import importlib


def require_extra(module: str, extra: str, needed_by: str) -> None:
    """ValueError (one line: what needs it, the pip command) if `module` cannot be imported.

    Call it before the work that needs the module starts, so that a long run does not
    fail at its end.
    """
    try:
        importlib.import_module(module)
    except ImportError:
        package = module.split(".")[-1] if module.startswith("torch.") else module.split(".")[0]
        raise ValueError(
            f"{needed_by} needs the {package} package: pip install 'disagmoe[{extra}]'"
        ) from None
