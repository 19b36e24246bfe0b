from setuptools import setup

# The C ring is compiled by cffi as part of this build (pip install . / -e .).
setup(cffi_modules=["csrc/build_ring.py:ffibuilder"])
