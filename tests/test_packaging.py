"""The distribution as a user gets it: `python -m build` makes an sdist and a wheel built from that
sdist; both carry every non-Python file the packages read, the license and the metadata. The wheel,
installed non-editable into a fresh virtual environment, finds the FFI launcher source where the
launcher looks for it and runs the layer on the CPU with the same result as this checkout.

The new virtual environment sees the site-packages of the interpreter running the tests, whatever
that is (a venv, a conda-like environment or a global python), through a `.pth` file listing
them after its own: `--system-site-packages` would give the *base* interpreter's site instead,
which inside a venv lacks jax. The wheel is installed with --no-deps, so jax, numpy and ml_dtypes
come from the running environment instead of being downloaded again (hundreds of MB), while the
moe_jax code comes only from the wheel (checked: the imported package lives in the venv; a path
line in a `.pth` runs no other `.pth`, so an editable install of this checkout stays invisible).
Building needs `build`, setuptools and wheel from the package index.

Also here: each command-line entry point names itself as it is invoked, and a missing optional
extra names the extra to install.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax

REPO = Path(__file__).resolve().parents[1]
# Non-Python files the packages read at run time (path inside the installed packages).
PACKAGE_DATA = ("custom_calls/native/csrc/launch_handler.cc", "custom_calls/cuda/w4a8_gemm_sm90.cuh")
COPY_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", ".ipynb_checkpoints", "*.so", "*.npz")
TIMEOUT_S = 300


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _run(cmd: list[str], **kw) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _tiny_layer():
    """A small quantized layer and its input: (config, params, x (13, 256) bf16)."""
    config = moe_jax.MoEConfig.deepseek_v3().scaled(num_experts=8, top_k=4, hidden_size=256,
                                                   intermediate_size=128)
    params = moe_jax.prepare_params(moe_jax.init_params(jax.random.key(0), config), config)
    x = jax.random.normal(jax.random.key(1), (13, 256), jnp.float32).astype(jnp.bfloat16)
    return config, params, x


# Runs inside the venv: what the installed package finds, and the tiny layer's output.
CHECK = textwrap.dedent("""
    import importlib.metadata, json, sys
    import numpy as np, jax.numpy as jnp
    import moe_jax
    from custom_calls.native import launch
    sys.path.insert(0, {tests!r})
    from test_packaging import _tiny_layer
    config, params, x = _tiny_layer()
    y = moe_jax.moe_forward(x, params, config, backend="reference")
    np.save({out!r}, np.asarray(y.astype(jnp.float32)))
    src = launch.HANDLER_SOURCE
    print(json.dumps(dict(moe_jax=moe_jax.__file__, launch=launch.__file__, version=moe_jax.__version__,
                          dist_version=importlib.metadata.version("moe-jax"), source=str(src),
                          source_is_file=src.is_file(), source_bytes=src.read_bytes().hex() if src.is_file() else "")))
""")


def _inherit_site_packages(venv: Path) -> None:
    """Make `venv` see the running interpreter's site-packages, after its own (module docstring)."""
    py = venv / "bin" / "python"
    own = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    dirs = [p for p in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                      *sys.path]) if p.endswith(("site-packages", "dist-packages"))
            and Path(p).is_dir()]
    assert dirs, f"no site-packages on sys.path of {sys.executable}"
    (Path(own) / "_moe_jax_test_parent_site.pth").write_text("\n".join(dirs) + "\n")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """Build sdist + wheel from a copy of the checkout, install the wheel into a fresh venv and run
    CHECK there: {sdist, wheel, venv, check (CHECK's JSON), y (its layer output)}. Under pytest-xdist
    the tests using it may land on different workers: the first builds into the run's shared temporary
    directory under a file lock, the others wait for it and read its result (one build per run)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _build_dist(tmp_path_factory.mktemp("dist"))
    shared = tmp_path_factory.getbasetemp().parent / "moe_jax_dist"
    shared.mkdir(exist_ok=True)
    done = shared / "dist.json"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            built = _build_dist(shared / "build")
            done.write_text(json.dumps(dict(sdist=str(built["sdist"]), wheel=str(built["wheel"]),
                                            venv=str(built["venv"]), check=built["check"])))
    built = json.loads(done.read_text())
    return dict(sdist=Path(built["sdist"]), wheel=Path(built["wheel"]), venv=Path(built["venv"]),
                check=built["check"], y=np.load(shared / "build" / "y.npy"))


def _build_dist(tmp: Path) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / "src"  # setuptools writes build/ and *.egg-info into the tree it builds
    shutil.copytree(REPO, src, ignore=COPY_IGNORE)
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    _inherit_site_packages(venv)
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", "build"])
    _run([py, "-m", "build", "--outdir", str(tmp / "out"), str(src)])  # the wheel is built from the sdist
    (sdist,) = (tmp / "out").glob("*.tar.gz")
    (wheel,) = (tmp / "out").glob("*.whl")
    _run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
    work = tmp / "work"  # not the checkout: '' on sys.path must not find the source tree
    work.mkdir()
    out = tmp / "y.npy"
    check = json.loads(_run([py, "-c", CHECK.format(tests=str(REPO / "tests"), out=str(out))],
                            cwd=work).strip().splitlines()[-1])
    return dict(sdist=sdist, wheel=wheel, venv=venv, check=check, y=np.load(out))


@pytest.mark.slow  # the dist fixture builds an sdist and a wheel
def test_sdist_and_wheel_carry_package_data_and_license(dist):
    with tarfile.open(dist["sdist"]) as tar:
        root = tar.getnames()[0].split("/")[0]
        sdist = {n[len(root) + 1:]: n for n in tar.getnames()}
        for rel in (*PACKAGE_DATA, "LICENSE", "pyproject.toml", "MANIFEST.in"):
            assert rel in sdist, f"sdist lacks {rel}"
            assert tar.extractfile(sdist[rel]).read() == (REPO / rel).read_bytes(), rel
    with zipfile.ZipFile(dist["wheel"]) as whl:
        names = set(whl.namelist())
        for rel in PACKAGE_DATA:
            assert rel in names, f"wheel lacks {rel}"
            assert whl.read(rel) == (REPO / rel).read_bytes()
        (license_,) = [n for n in names if ".dist-info/" in n and n.endswith("LICENSE")]
        assert whl.read(license_) == (REPO / "LICENSE").read_bytes()
        assert b"Apache License" in whl.read(license_) and b"Version 2.0, January 2004" in whl.read(license_)
        assert not [n for n in names if n.startswith(("tests/", "examples/"))]


@pytest.mark.slow  # the dist fixture builds an sdist and a wheel
def test_wheel_metadata(dist):
    with zipfile.ZipFile(dist["wheel"]) as whl:
        (meta,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        lines = whl.read(meta).decode().splitlines()
    field = lambda key: [ln.split(": ", 1)[1] for ln in lines if ln.startswith(key + ": ")]  # noqa: E731
    assert field("Version") == [moe_jax.__version__]
    assert field("License") == ["Apache-2.0"]
    urls = dict(u.split(", ", 1) for u in field("Project-URL"))
    assert set(urls) == {"Homepage", "Documentation", "Repository", "Issues"}
    assert all(u.startswith("https://github.com/moe-jax/moe-jax") for u in urls.values())
    gpu = {r.split(";")[0].strip() for r in field("Requires-Dist") if 'extra == "gpu"' in r}
    names = {r.split("[")[0].split("=")[0].split(">")[0].split("<")[0] for r in gpu}
    # one command for a GPU user: a CUDA build of jax and every kernel dependency
    assert names == {"jax", "sgl-deep-gemm", "jax-triton", "triton", "cuda-bindings"}, gpu
    assert any(r.startswith("jax[cuda") for r in gpu), gpu


@pytest.mark.slow  # the dist fixture builds an sdist and a wheel
def test_installed_wheel_finds_launcher_source_and_runs_on_cpu(dist):
    check, venv = dist["check"], dist["venv"].resolve()
    for module in ("moe_jax", "launch"):  # the code came from the wheel, not from this checkout
        assert Path(check[module]).resolve().is_relative_to(venv), check[module]
    source = Path(check["source"])
    assert check["source_is_file"] and source.resolve().is_relative_to(venv), check["source"]
    assert _sha(bytes.fromhex(check["source_bytes"])) == _sha((REPO / PACKAGE_DATA[0]).read_bytes())
    assert check["version"] == check["dist_version"] == moe_jax.__version__
    config, params, x = _tiny_layer()
    want = np.asarray(moe_jax.moe_forward(x, params, config, backend="reference").astype(jnp.float32))
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(dist["y"], want)  # same code, same inputs, same bits


def test_version_is_the_one_in_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["version"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "moe_jax.__version__"}
    assert isinstance(moe_jax.__version__, str) and moe_jax.__version__.count(".") == 2


@pytest.mark.parametrize("module,argv,prog", [
    ("moe_jax.bench.__main__", ["--help"], "python -m moe_jax.bench"),
    ("moe_jax.bench.__main__", ["layer", "--help"], "python -m moe_jax.bench layer"),
    ("moe_jax.bench.__main__", ["gemm", "--help"], "python -m moe_jax.bench gemm"),
    ("moe_jax.bench.__main__", ["parallel", "--help"], "python -m moe_jax.bench parallel"),
    ("moe_jax.bench.__main__", ["triton", "--help"], "python -m moe_jax.bench triton"),
    ("moe_jax.bench.tune", ["--help"], "python -m moe_jax.bench.tune"),
    ("moe_jax.parallel.bytes", ["--help"], "python -m moe_jax.parallel.bytes"),
])
def test_cli_help_names_the_command_as_invoked(module, argv, prog, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")


def test_missing_nn_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flax", None)  # as if flax were not installed
    monkeypatch.delitem(sys.modules, "moe_jax.nn", raising=False)
    with pytest.raises(ImportError, match=r"moe_jax.nn needs flax, which is not installed: "
                                          r"pip install 'moe-jax\[nn\]'"):
        importlib.import_module("moe_jax.nn")
