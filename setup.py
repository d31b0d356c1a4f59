"""The one compiled part: the Monitor's per-step host path (`collector/csrc/`, see fast.h).
Optional: a host without a C compiler installs without it, and every step takes the Python
path."""

from pathlib import Path

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshscope.collector._fast",
            sorted(str(p) for p in Path("collector/csrc").glob("*.c")),
            depends=sorted(str(p) for p in Path("collector/csrc").glob("*.h")),
            # hidden: only PyInit__fast leaves the library
            extra_compile_args=[
                "-O2",
                "-Wall",
                "-fvisibility=hidden",
                "-Werror=implicit-function-declaration",
            ],
            optional=True,
        )
    ]
)
