"""The quick demo's trips of the sixteenth session's walkthrough at c750c7d (docs/walkthroughs.md, "The
quick demo at c750c7d", its "Trips" paragraph) still there at HEAD: the build banner's estimate, the
served-format line, each phase's live closing line, the notes' gains, the two ceilings, the third
ceiling's value, the dip said twice, the alarm note's clock and the plot's swap labels. The figures
are that run's report.json's, copied here."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# (1) the build banner's estimate -------------------------------------------------------------------------

def test_the_build_banner_estimate_covers_the_builds_measured_on_two_idle_cores():
    """c750c7d's banner: "about 3-5 minutes on 2 idle cores", then "llama.cpp built in 120 s" (the AMX
    Xeon, alone); 39d6919's build took 161 s on the Zen 4, alone. Each inside the banner's range."""
    text = (ROOT / "scripts" / "install").read_text()
    m = re.search(r"about (\d+)-(\d+) minutes on 2 idle cores", text)
    assert m, "the banner's estimate is gone"
    low, high = int(m.group(1)) * 60, int(m.group(2)) * 60
    for built_s in (120, 161):
        assert low <= built_s <= high, (built_s, m.group(0))
    # the header comment says the same range
    assert f"~{m.group(1)}-{m.group(2)} min on 2 cores" in text
