"""`python -m meshscope ...`, the same as the `meshscope` command."""

from meshscope.cli import main

main()
