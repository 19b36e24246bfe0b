from setuptools import setup

# The C ring is compiled by cffi as part of this build (pip install . / -e .), against
# Python's limited API: one cp311-abi3 wheel per platform serves every CPython >= 3.11.
setup(cffi_modules=["csrc/build_ring.py:ffibuilder"],
      options={"bdist_wheel": {"py_limited_api": "cp311"}})
