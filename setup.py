import ast
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read(*parts: str) -> str:
    with open(os.path.join(HERE, *parts), encoding="utf-8") as f:
        return f.read()


def package_version() -> str:
    """``__version__`` of ``startrail_megatron/__init__.py``, read without importing the
    package (the one place the version is written)."""
    for node in ast.parse(read("startrail_megatron", "__init__.py")).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__version__"
        ]:
            return ast.literal_eval(node.value)
    raise RuntimeError("startrail_megatron/__init__.py sets no __version__")


setup(
    name="startrail_megatron",
    version=package_version(),
    description="StarTrail concentric-ring sequence parallelism for Megatron-core and DeepSpeed",
    long_description=read("README.md"),
    long_description_content_type="text/markdown",
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["startrail_megatron", "startrail_megatron.*"]),
    install_requires=["torch>=2.4"],
    package_data={"startrail_megatron.megatron.training": ["megatron_lm_flags.txt"]},
    extras_require={
        "megatron": ["megatron-core>=0.13,<0.20", "einops", "psutil"],
        "deepspeed": ["deepspeed>=0.16", "pydantic>=2", "transformers>=5.0"],
        "gpu": ["flash-attn>=2.5,<2.9"],  # the releases the adapter reads (kernels/flash_attn.py)
        "dev": ["pytest", "ruff", "numpy", "matplotlib"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "startrail-bench=startrail_megatron.bench:main",
            "startrail-plan=startrail_megatron.planner.cli:main",
            "startrail-preprocess-data=startrail_megatron.megatron.preprocess_data:main",
        ]
    },
)
