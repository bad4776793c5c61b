"""`python -P -m meshfn.inference ...`: the backend as a process (serve) plus the fn commands."""

from meshfn.inference.cli import main

main()
