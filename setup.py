from setuptools import find_packages, setup

setup(
    name="startrail_megatron",
    version="0.1.0",
    description="StarTrail concentric-ring sequence parallelism for Megatron-core and DeepSpeed",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["startrail_megatron", "startrail_megatron.*"]),
    install_requires=["torch>=2.4"],
    package_data={"startrail_megatron.megatron.training": ["megatron_lm_flags.txt"]},
    extras_require={
        "megatron": ["megatron-core>=0.13,<0.20", "einops", "psutil"],
        "deepspeed": ["deepspeed>=0.16", "pydantic>=2", "transformers>=5.0"],
        "gpu": ["flash-attn>=2.5"],
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
