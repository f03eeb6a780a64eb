# Sourced at the start of a device call, or by a GPU check whose machine lacks DeepSpeed: installs the wheels carried
# in $WHEELS (default .whl/, git-ignored) into /tmp/site and puts it on PYTHONPATH, for a GPU machine without network
# whose image lacks DeepSpeed or carries an older transformers than volta_train supports (volta_train/versions.py).
# Nothing happens when $WHEELS holds no wheel.
#   source lab/gpu_checks/carried_wheels.sh && bash lab/gpu_checks/kernel_check.sh
# The wheels, for Python 3.12 there (`pip download --no-deps NAME==X -d .whl`; binary ones with
# `--only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64`):
#   DeepSpeed: PyPI ships only the sdist, so build it once on any machine:
#     DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==0.19.8 -w .whl
#   and what it needs beyond the image: hjson, pydantic, pydantic_core (binary), annotated_types, typing_inspection,
#   typing_extensions;
#   transformers (when the image's is below versions.TESTED) and what its release needs beyond the image: for 5.25,
#   huggingface_hub 2.x, kernels and regex (binary), hf_xet (binary), tomlkit, httpx2, httpcore2, truststore, anyio,
#   idna, click.
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" > /dev/null; then
  ${PYTHON:-python3} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    && echo "carried wheels installed: $(ls "$wheels" | sed 's/-py3.*\|-cp3.*//' | paste -sd' ')"
fi
