# Sourced at the start of a device call: installs the wheels carried in $WHEELS (default .whl/, git-ignored) into
# /tmp/site and puts it on PYTHONPATH, for a GPU machine without network whose image lacks DeepSpeed or carries an
# older transformers than volta_train supports (volta_train/versions.py). Nothing happens when $WHEELS is absent.
#   source lab/gpu_checks/carried_wheels.sh && bash lab/gpu_checks/kernel_check.sh
# Which wheels: DeepSpeed (built once with `DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==X -w .whl`), transformers
# and what its release needs beyond the image (huggingface_hub, kernels, httpx2, ...): `pip download --no-deps` each.
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    && echo "carried wheels installed: $(ls "$wheels" | sed 's/-py3.*\|-cp3.*//' | paste -sd' ')"
fi
