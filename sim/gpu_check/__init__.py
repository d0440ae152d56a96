"""`sprinter gpu`: every GPU figure the project owes, measured in one prepared run on a brief, offline GPU host.

    make gpu-bundle                 # here, where PyPI is reachable: the wheelhouse, the stubs, the entry points
    make gpu-check OUT=DIR          # there: the host's python3 and torch, nothing else installed
    sprinter gpu page --results DIR --page docs/benchmarks/gpu.md     # here again: the page section

wheelhouse.py builds the bundle, unpack.py (standard library only) lays it out on the host, check.py runs
the steps, page.py turns what came back into the page.
"""
