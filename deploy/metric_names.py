#!/usr/bin/env python3
"""Checks that every grandis metric the alert rules and the Grafana dashboard use is exported.

    metric_names.py --exported ROLE=FILE [ROLE=FILE...] --rules alerts.yml --dashboard grandis.json
    metric_names.py --prometheus URL --dashboard grandis.json
    metric_names.py --self-test

ROLE is `coordinator` or `daemon` (the scrape job `grandis-ROLE` of prometheus.yml), FILE a
/metrics page (OpenMetrics or Prometheus text) scraped from a live coordinator and
daemons after a job ran (families without samples are not rendered at all, so a page scraped
before any job lacks the per-job families). Sample names are derived from the type the
way Prometheus sees them: counters as `<name>_total`, histograms and summaries with `_bucket`,
`_sum`, `_count`. Referenced names are the `grandis_*` identifiers in every PromQL expression
(alert `expr`, dashboard target `expr` and query-variable definitions). Also checks the
dashboard's structure: unique panel ids, a datasource and at least one query per panel, panels
inside the 24-column grid and not overlapping. No exported series may carry a `job` or
`instance` label: Prometheus would store it as `exported_job` / `exported_instance`, because it
sets those two itself (the scrape job and target).

With --prometheus, checks against a real Prometheus that scrapes grandis with
deploy/prometheus/prometheus.yml and alerts.yml: every target up, every rule evaluates without
error, per-job series of both scrape jobs carry the `grandis_job` label (exported so, with no
relabelling in prometheus.yml), no grandis series has an `exported_job` or `exported_instance`
label, and every dashboard query (template variables filled with "all") returns data. Exit 1
with one line per problem.
"""

import argparse
import json
import re
import sys
import time
import urllib.parse
import urllib.request

NAME = re.compile(r"\bgrandis_[a-zA-Z0-9_]*[a-zA-Z0-9]\b")
# Label names after `by (` / `on (` ... and inside selectors `{a="..."}`: checked against the
# labels of exported samples when samples exist.
SELECTOR = re.compile(r"(grandis_[a-zA-Z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')

SUFFIXES = {
    "counter": ["_total"],
    "histogram": ["_bucket", "_sum", "_count", "_created"],
    "summary": ["_sum", "_count", "_created", ""],
    "gaugehistogram": ["_bucket", "_gsum", "_gcount"],
}

# Labels that Prometheus adds to every series (scrape target labels). An exported label of the
# same name is stored as `exported_<name>` instead (honor_labels is off), and prometheus.yml
# renames none back, so grandis must not export them.
TARGET_LABELS = {"job", "instance"}
# grandis_* identifiers in PromQL that are label names, not metrics.
LABEL_NAMES = {"grandis_job"}


def stored_labels(names):
    """The label names Prometheus stores for a sample with exported label `names`, scraped with
    deploy/prometheus/prometheus.yml (target labels not included)."""
    return {f"exported_{n}" if n in TARGET_LABELS else n for n in names}


def exported(texts):
    """The sample names (both bare and as (scrape job, name)) and, per (scrape job, name), the
    label names its samples get in Prometheus (see stored_labels). `texts` is a list of
    (scrape job, page text)."""
    names, labels = set(), {}
    for job, text in texts:
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                parts = line.split()
                if len(parts) >= 4:
                    fam, kind = parts[2], parts[3]
                    for suffix in SUFFIXES.get(kind, [""]):
                        names.add(fam + suffix)
                        names.add((job, fam + suffix))
            elif line and not line.startswith("#"):
                m = SAMPLE.match(line)
                if m:
                    names.add(m.group(1))
                    names.add((job, m.group(1)))
                    seen = labels.setdefault((job, m.group(1)), set())
                    seen.update(stored_labels(LABEL.findall(m.group(3) or "")))
    return names, labels


def rule_exprs(text):
    """The `expr:` values of a Prometheus rule file (folded `>-` blocks included), without a YAML
    library: the file is ours and uses only these two forms."""
    exprs, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*(?:-\s+)?)expr:\s*(.*)$", lines[i])
        if m:
            indent, rest = len(m.group(1)), m.group(2).strip()
            if rest in (">-", ">", "|", "|-"):
                block = []
                i += 1
                while i < len(lines) and (
                    not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
                ):
                    block.append(lines[i].strip())
                    i += 1
                exprs.append(" ".join(block))
                continue
            exprs.append(rest)
        i += 1
    return exprs


def dashboard_exprs(dash, problems):
    exprs, ids, boxes = [], set(), []

    def walk(panels):
        for p in panels:
            pid, title = p.get("id"), p.get("title", "?")
            if pid in ids:
                problems.append(f"dashboard: panel id {pid} is used twice ({title!r})")
            ids.add(pid)
            g = p.get("gridPos", {})
            x, y, w, h = (g.get(k) for k in ("x", "y", "w", "h"))
            if None in (x, y, w, h) or x < 0 or w < 1 or x + w > 24 or h < 1:
                problems.append(f"dashboard: panel {title!r} has a bad gridPos {g}")
            elif not (p.get("type") == "row" and p.get("collapsed")):
                for (bx, by, bw, bh, bt) in boxes:
                    if x < bx + bw and bx < x + w and y < by + bh and by < y + h:
                        problems.append(f"dashboard: panels {title!r} and {bt!r} overlap")
                boxes.append((x, y, w, h, title))
            if p.get("type") == "row":
                walk(p.get("panels", []))
                continue
            if not p.get("datasource"):
                problems.append(f"dashboard: panel {title!r} has no datasource")
            targets = p.get("targets", [])
            if not targets:
                problems.append(f"dashboard: panel {title!r} has no query")
            for t in targets:
                if not t.get("expr"):
                    problems.append(f"dashboard: panel {title!r} has a query without expr")
                else:
                    exprs.append((f"dashboard panel {title!r}", t["expr"]))

    walk(dash.get("panels", []))
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else (q or "")
            exprs.append((f"dashboard variable ${v.get('name')}", q))
            if v.get("definition") and v["definition"] != q:
                problems.append(f"dashboard: variable ${v.get('name')}: definition != query")
    return exprs


def check(texts, rules_text, dash, problems):
    names, labels = exported(texts)
    if not any(isinstance(n, str) and n.startswith("grandis_") for n in names):
        problems.append("exported: no grandis_* metric at all in the scraped pages")
    for (job, name), stored in sorted(labels.items()):
        for label in sorted(TARGET_LABELS):
            if f"exported_{label}" in stored:
                problems.append(f"exported by {job}: {name} has the label {label!r}, which "
                                f"Prometheus stores as exported_{label} (it sets {label!r} "
                                f"itself, for the scrape target)")
    refs = [("alert rule", e) for e in rule_exprs(rules_text)]
    if not refs:
        problems.append("alerts: no `expr:` found")
    refs += dashboard_exprs(dash, problems)
    used = 0
    for where, expr in refs:
        for name in NAME.findall(expr):
            if name in LABEL_NAMES:
                continue
            used += 1
            if name not in names:
                problems.append(f"{where}: {name} is not exported (expression: {expr})")
        for name, body in SELECTOR.findall(expr):
            # A selector pinned to one scrape job is checked against that exporter's labels
            # only (the coordinator and the daemons export some names with different labels).
            pinned = re.findall(r'\bjob\s*=\s*"([^"]+)"', body)
            for j in pinned:
                if (j, name) not in names:
                    problems.append(f"{where}: {name} is not exported by the {j} scrape job "
                                    f"(expression: {expr})")
            jobs = pinned or sorted({j for j, _ in labels})
            seen = set()
            for j in jobs:
                seen |= labels.get((j, name), set())
            if not seen:
                continue  # no samples scraped: label names cannot be checked
            for label in MATCHER.findall(body):
                if label not in seen and label not in TARGET_LABELS:
                    scraped = f" from {', '.join(pinned)}" if pinned else ""
                    problems.append(
                        f"{where}: {name}{scraped} has no label {label!r} (labels as stored: "
                        f"{', '.join(sorted(seen)) or 'none'})"
                    )
    return used


GRAFANA_VARS = {"grandis_job": ".*", "server": ".*", "__range": "1h", "__rate_interval": "1m",
                "__interval": "15s"}


def fill_vars(expr):
    return re.sub(r"\$\{?(\w+)\}?", lambda m: GRAFANA_VARS.get(m.group(1), m.group(0)), expr)


def prom_get(base, path, **params):
    url = f"{base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{path}: {body}")
    data = body["data"]
    # Queries answer {"resultType": ..., "result": [...]}; label values a plain list.
    return data["result"] if isinstance(data, dict) and "result" in data else data


def check_prometheus(base, dash, problems, wait_s=60):
    # Until every target is up and has been scraped a few times (increase() needs two samples).
    deadline = time.monotonic() + wait_s
    while True:
        ups = prom_get(base, "/api/v1/query", query="count_over_time(up[5m])")
        down = prom_get(base, "/api/v1/query", query="up == 0")
        if len(ups) >= 3 and not down and all(float(u["value"][1]) >= 3 for u in ups):
            break
        if time.monotonic() > deadline:
            problems.append(f"prometheus: targets not all up and scraped 3 times within {wait_s} "
                            f"s: {ups} down: {down}")
            return 0
        time.sleep(0.5)
    # One evaluation of the rules after the scrapes.
    time.sleep(1.5)
    for group in prom_get(base, "/api/v1/rules")["groups"]:
        for rule in group["rules"]:
            if rule.get("health") != "ok":
                problems.append(f"prometheus: rule {rule.get('name')}: health "
                                f"{rule.get('health')}: {rule.get('lastError')}")
    for job in ("grandis-coordinator", "grandis-daemon"):
        series = prom_get(base, "/api/v1/query", query=f'grandis_job_loss{{job="{job}"}}')
        if not series:
            problems.append(f"prometheus: no grandis_job_loss series from {job}")
        for s in series:
            if "grandis_job" not in s["metric"]:
                problems.append(f"prometheus: {s['metric']} has no grandis_job label")
    for label in sorted(TARGET_LABELS):
        clashes = prom_get(base, "/api/v1/query",
                           query=f'{{__name__=~"grandis_.+", exported_{label}=~".+"}}')
        for s in clashes:
            problems.append(f"prometheus: {s['metric']} has an exported_{label} label (the "
                            f"exporter sent {label!r}, which Prometheus sets itself)")
    queries = 0
    for where, expr in dashboard_exprs(dash, problems):
        expr = fill_vars(expr)
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", expr)
        try:
            if m:
                data = prom_get(base, f"/api/v1/label/{m.group(2)}/values",
                                **{"match[]": m.group(1)})
            else:
                data = prom_get(base, "/api/v1/query", query=expr)
        except Exception as e:  # HTTP 400 carries the PromQL parse error
            detail = e.read().decode() if hasattr(e, "read") else str(e)
            problems.append(f"{where}: query failed: {expr}: {detail}")
            continue
        queries += 1
        if not data:
            problems.append(f"{where}: no data for {expr}")
    return queries


def self_test():
    page = (
        "# TYPE grandis_up gauge\ngrandis_up{label=\"a\"} 1\n"
        "# TYPE grandis_jobs counter\n# TYPE grandis_lat histogram\n"
    )
    rules = "groups:\n  - rules:\n      - expr: >-\n          grandis_up{label=\"a\"} == 0\n" \
        "          and grandis_jobs_total > 0\n      - expr: grandis_lat_bucket > 1\n"
    panel = {"id": 1, "title": "p", "datasource": {"uid": "x"},
             "gridPos": {"x": 0, "y": 0, "w": 24, "h": 2},
             "targets": [{"expr": "sum(grandis_up)"}]}
    good = {"panels": [panel]}
    probs = []
    pages = [("grandis-coordinator", page), ("grandis-daemon", 'grandis_up{server="x"} 1\n')]
    assert check(pages, rules, good, probs) == 4 and probs == [], probs
    bad_rules = rules.replace("grandis_jobs_total", "grandis_jobz_total").replace(
        'label="a"', 'lable="a"')
    bad = {"panels": [panel, dict(panel, gridPos={"x": 12, "y": 1, "w": 12, "h": 2})]}
    probs = []
    bad_rules += '      - expr: grandis_up{job="grandis-daemon", label="a"} > 0\n'
    bad_rules += '      - expr: grandis_lat_sum{job="grandis-daemon"} > 0\n'
    check(pages, bad_rules, bad, probs)
    text = "\n".join(probs)
    assert sum("has no label 'label'" in p for p in probs) == 1, probs  # only the daemon one
    for want in ("grandis_jobz_total is not exported", "has no label 'lable'",
                 "grandis_lat_sum is not exported by the grandis-daemon scrape job",
                 "panel id 1 is used twice", "overlap"):
        assert want in text, (want, text)
    # The per-job label as Prometheus stores it: both exporters send grandis_job. One exporting
    # `job` (or `instance`) instead is reported as such, and its `job` is stored as
    # exported_job, which the selectors below do not find.
    per_job = {"panels": [dict(panel, targets=[
        {"expr": 'grandis_job_loss{job="grandis-coordinator", grandis_job=~"$grandis_job"}'},
        {"expr": 'grandis_job_loss{job="grandis-daemon", grandis_job=~"$grandis_job"}'}])]}
    loss_rules = "groups:\n  - rules:\n      - expr: grandis_job_loss > 1\n"
    good_pages = [("grandis-coordinator", 'grandis_job_loss{grandis_job="1"} 1\n'),
                  ("grandis-daemon", 'grandis_job_loss{grandis_job="1",server="x"} 1\n')]
    probs = []
    check(good_pages, loss_rules, per_job, probs)
    assert probs == [], probs
    for i, (role, _) in enumerate(good_pages):
        pages = list(good_pages)
        pages[i] = (role, 'grandis_job_loss{job="1",server="x"} 1\n')
        probs = []
        check(pages, loss_rules, per_job, probs)
        assert len(probs) == 2, probs
        assert f"exported by {role}: grandis_job_loss has the label 'job'" in probs[0], probs
        assert "has no label 'grandis_job' (labels as stored: exported_job, server)" \
            in probs[1] and role in probs[1], probs
    probs = []
    check(good_pages + [("grandis-daemon", 'grandis_up{instance="x"} 1\n')], loss_rules,
          per_job, probs)
    assert len(probs) == 1 and "grandis_up has the label 'instance'" in probs[0], probs
    probs = []
    check([("grandis-daemon", "")], rules, good, probs)
    assert any("no grandis_* metric" in p for p in probs), probs
    print("metric_names.py self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exported", nargs="+", metavar="FILE")
    ap.add_argument("--rules")
    ap.add_argument("--dashboard")
    ap.add_argument("--prometheus", metavar="URL")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return 0
    if a.prometheus:
        if not a.dashboard:
            ap.error("--prometheus needs --dashboard")
        with open(a.dashboard, encoding="utf-8") as fh:
            dash = json.load(fh)
        problems = []
        n = check_prometheus(a.prometheus.rstrip("/"), dash, problems)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            return 1
        print(f"prometheus: targets up, rules healthy, grandis_job label present, all {n} "
              f"dashboard queries return data")
        return 0
    if not (a.exported and a.rules and a.dashboard):
        ap.error("--exported, --rules and --dashboard are required")
    texts = []
    for item in a.exported:
        role, sep, f = item.partition("=")
        if not sep or role not in ("coordinator", "daemon"):
            ap.error(f"--exported {item}: expected coordinator=FILE or daemon=FILE")
        with open(f, encoding="utf-8") as fh:
            texts.append((f"grandis-{role}", fh.read()))
    with open(a.rules, encoding="utf-8") as fh:
        rules_text = fh.read()
    try:
        with open(a.dashboard, encoding="utf-8") as fh:
            dash = json.load(fh)
    except (OSError, ValueError) as e:
        print(f"{a.dashboard}: {e}", file=sys.stderr)
        return 1
    problems = []
    used = check(texts, rules_text, dash, problems)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    names, _ = exported(texts)
    count = len([n for n in names if isinstance(n, str) and n.startswith("grandis_")])
    print(f"metric names: {used} references in {a.rules} and {a.dashboard}, all among the "
          f"{count} exported grandis_* names, with the labels they select on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
