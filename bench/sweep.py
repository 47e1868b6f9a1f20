"""The decoder's side-by-side sweep (same as `daemonctl bench`): prints a table and the JSON.

    python bench/sweep.py [--quick] [--workloads prose,code,math] [--gammas 1,2,3,4,6,8] [--out FILE]
"""

import typer

from daemon.cli_decode import bench

if __name__ == "__main__":
    typer.run(bench)
