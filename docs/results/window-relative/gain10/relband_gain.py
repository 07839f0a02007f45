"""One-off (not in the library): relative aft-local with its offsets scaled by GAIN, so that
Adam's per-step move of about lr on rel_bias moves the bias GAIN times as far."""

import sys

from aftlab.cli import main
from aftlab.mixers.aft import local

GAIN = 10.0
band, entries = local.AFTLocal.band, local.AFTLocal.bias_entries


def scaled_band(self, T):
    b = band(self, T)
    return b * GAIN if self.relative_bias else b


def scaled_entries(self, t, cols):
    e = entries(self, t, cols)
    return e * GAIN if self.relative_bias else e


local.AFTLocal.band, local.AFTLocal.bias_entries = scaled_band, scaled_entries
sys.exit(main(sys.argv[1:]))
