"""Build-time model of the digits function (runs on the build host, never in the guest): logistic
regression trained on scikit-learn's bundled 8x8 digits, written to OUTDIR/model.onnx with the
held-out rows in build-report.json. The recipe is meshfn.testing.onnx_models (shared with the
compiler's tests and bench/models.py).
Usage: python -P train.py OUTDIR   (in the function's staging folder)
"""

import sys
from pathlib import Path

from meshfn.testing.onnx_models import prepare_function

if __name__ == "__main__":
    prepare_function(Path(sys.argv[1]))
