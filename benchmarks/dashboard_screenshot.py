"""The README's picture of the dashboard: a real 3-node swarm of staggered simulated devices
(one node much slower, which evaluates), its live page in headless Chromium, photographed once
round 4 of 8 is done. Writes benchmarks/plots/dashboard.png.

    flock /tmp/drift-cpu.lock python3 benchmarks/dashboard_screenshot.py
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

from harness.simulate import SIM, Swarm, make_task_repo

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "benchmarks" / "plots" / "dashboard.png"


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="drift-shot-"))
    try:
        recipe = make_task_repo(
            work / "repo", {**SIM, "name": "shakespeare-tiny", "min_nodes": 3, "rounds": 8, "inner_steps": 12}
        )
        sw = Swarm(recipe, work)
        url = sw._wait_for(r"dashboard:\s+(\S+)", 30)
        for name, step in (("h200", "0.02"), ("laptop", "0.06"), ("old-cpu", "1.5")):
            sw.join(name=name, sim_step=step)
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox", "--disable-gpu"])
            page = b.new_page(viewport={"width": 1200, "height": 900}, device_scale_factor=1)
            page.goto(url)
            while not page.evaluate("Number(document.body.dataset.round) >= 4"):  # (the page's CSP refuses
                page.wait_for_timeout(200)  # wait_for_function's string eval)
            page.wait_for_timeout(600)
            page.screenshot(path=str(OUT), full_page=True)
            b.close()
        print(f"wrote {OUT} ({re.sub(r'token=.*', 'token=...', url)})")
        for proc in [sw.coord, *sw.nodes]:  # the picture is taken: the rest of the run is not needed
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
