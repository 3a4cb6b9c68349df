"""The agent skill: ships inside the package, has valid frontmatter and working links, installs where agents look."""
from __future__ import annotations

import filecmp
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from divtrace.cli.app import main
from divtrace.cli.skill_cmd import skill_source

ROOT = Path(__file__).resolve().parent.parent


def _frontmatter(text: str) -> dict:
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert m, "SKILL.md must start with YAML frontmatter between --- lines"
    return yaml.safe_load(m.group(1))


def test_skill_is_inside_the_package_and_at_repo_top():
    src = skill_source()
    assert src == ROOT / "divtrace" / "skill" / "divtrace"
    assert (ROOT / "skill" / "divtrace" / "SKILL.md").resolve() == (src / "SKILL.md").resolve()
    assert (src / "references").is_dir() and list((src / "references").glob("*.md"))


def test_frontmatter_says_when_to_use_it():
    text = (skill_source() / "SKILL.md").read_text()
    fm = _frontmatter(text)
    assert fm["name"] == "divtrace"
    desc = fm["description"].lower()
    for phrase in ("logprob", "kl", "same weights, different outputs", "inference", "train"):
        assert phrase in desc, phrase
    assert len(fm["description"]) <= 1024  # agent loaders cap the description
    assert 100 <= len(text.splitlines()) <= 260


def test_sections_cover_the_workflow_and_causes():
    text = (skill_source() / "SKILL.md").read_text()
    for word in ("Record", "--map", "Bisect", "Repro", "fix", "Verify", "shape sweep", "Profile", "end to end",
                 "hash mode", "--include"):
        assert word in text, word
    causes = (skill_source() / "references" / "causes.md").read_text().lower()
    for cause in ("rmsnorm cast order", "residual", "fused add+norm", "rotary", "cos/sin", "sdpa", "flash",
                  "split-kv", "split-k", "batch-size", "tensor-parallel", "silu", "moe combine", "top-k ties",
                  "lm_head", "log_softmax", "temperature", "raw vs processed"):
        assert cause in causes, cause


def test_relative_links_resolve():
    src = skill_source()
    for md in [src / "SKILL.md", *sorted((src / "references").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", md.read_text()):
            if "://" in target:
                continue
            assert (md.parent / target).is_file(), f"{md.name}: broken link {target}"


def _same_tree(a: Path, b: Path) -> bool:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    return all(_same_tree(a / d, b / d) for d in cmp.common_dirs)


def test_install_default_dirs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["skill", "install"]) == 0
    out = capsys.readouterr().out
    for d in (".claude/skills/divtrace", ".agents/skills/divtrace"):
        assert _same_tree(skill_source(), tmp_path / d), d
        assert f"installed {d}/SKILL.md" in out


def test_install_dir_replaces_an_old_copy_but_nothing_else(tmp_path, capsys):
    dest = tmp_path / "skills"
    assert main(["skill", "install", "--dir", str(dest)]) == 0
    stale = dest / "divtrace" / "references" / "stale.md"
    stale.write_text("from an older version\n")
    assert main(["skill", "install", "--dir", str(dest), "--json"]) == 0
    assert not stale.exists() and _same_tree(skill_source(), dest / "divtrace")
    capsys.readouterr()
    other = tmp_path / "other"
    (other / "divtrace").mkdir(parents=True)
    (other / "divtrace" / "notes.txt").write_text("mine\n")
    assert main(["skill", "install", "--dir", str(other)]) == 2
    assert "is not a divtrace skill" in capsys.readouterr().err
    assert (other / "divtrace" / "notes.txt").read_text() == "mine\n"


def test_path_prints_packaged_location(capsys):
    assert main(["skill", "path"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed == skill_source() and (printed / "SKILL.md").is_file()


def test_wheel_ships_the_skill(tmp_path):
    """`divtrace skill path` must work from a normal (non-editable) install: the files are package data."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "divtrace", src / "divtrace", ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("pip not available")
    assert r.returncode == 0, r.stderr[-2000:]
    names = set(zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist())
    packaged = {f"divtrace/skill/divtrace/{p.relative_to(skill_source()).as_posix()}"
                for p in skill_source().rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert "divtrace/skill/divtrace/SKILL.md" in packaged and packaged <= names


def test_install_in_this_checkout_leaves_nothing_untracked():
    """Issue 26 snag 10: `divtrace skill install` (default dirs) in a clone of divtrace left untracked .claude/ and
    .agents/; both are ignored by the project's .gitignore."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    for d in (".claude/skills/divtrace/SKILL.md", ".agents/skills/divtrace/references/causes.md"):
        p = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", d], capture_output=True)
        assert p.returncode == 0, f"{d} is not ignored by .gitignore"


INTERNAL_RECORD_KNOBS = {"shard_bytes", "extra_meta", "flush_records"}  # tuning for tests and benches, not documented


@pytest.mark.parametrize("doc", ["divtrace/skill/divtrace/references/recording.md", "docs/contract.md"])
def test_documented_record_signature_is_complete(doc):
    """Issue 26 snag 5: the skill's API signature lacked compiled=, tokens=, token_layouts=."""
    import inspect

    import divtrace

    text = " ".join((ROOT / doc).read_text().split())
    m = re.search(r"`divtrace\.record\(model, path, \*, (.*?)\)`", text)
    assert m, f"{doc}: no `divtrace.record(model, path, *, ...)` signature"
    documented = {kw.split("=")[0].strip() for kw in m.group(1).split(", ")}
    params = set(inspect.signature(divtrace.record).parameters) - {"model", "path"} - INTERNAL_RECORD_KNOBS
    assert documented == params, (doc, sorted(params - documented), sorted(documented - params))


def test_skill_covers_compiled_models():
    """Issue 26 snag 5: references/recording.md said to disable torch.compile while recording; SKILL.md had no
    compiled section."""
    skill = (skill_source() / "SKILL.md").read_text()
    rec = (skill_source() / "references" / "recording.md").read_text()
    assert "**Compiled models.**" in skill and "--no-compiled" in skill and "inconclusive" in skill
    assert "Compiled models" in rec and "compiled=False" in rec
    assert not re.search(r"disable[^.]*torch\.compile", rec, re.S | re.I)


def test_the_project_refers_to_nothing_outside_it():
    """Issue 26 snag 6: examples/llama_pair.py pointed at an absolute path outside the project (a knowledge file users
    do not have). What the project refers to ships inside it: the example's cause ids are the catalogue's."""
    roots = [ROOT / "README.md", ROOT / "docs", ROOT / "examples", ROOT / "divtrace", ROOT / "scripts", ROOT / "bench"]
    files = [p for r in roots for p in ([r] if r.is_file() else r.rglob("*"))
             if p.is_file() and p.suffix in (".md", ".py", ".sh", ".yaml")]
    bad = [str(p.relative_to(ROOT)) for p in files
           if re.search(r"/work/|shared/knowledge|shared/CONTRACT", p.read_text(errors="replace"))]
    assert not bad, bad
    doc = (ROOT / "examples" / "llama_pair.py").read_text().split('"""')[1]
    assert "references/causes.md" in doc
    ids = set(re.findall(r"\((C\d+)\)", doc))
    causes = (skill_source() / "references" / "causes.md").read_text()
    headed = {i for line in causes.splitlines() if line.startswith("### ") for i in re.findall(r"C\d+", line)}
    assert ids and ids <= headed, sorted(ids - headed)
