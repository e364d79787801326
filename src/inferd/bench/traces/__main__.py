"""`python -m inferd.bench.traces`: rewrite the shipped synthetic traces."""
from inferd.bench.traces import write

for p in write():
    print(p)
