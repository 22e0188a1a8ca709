"""The RLJob API (`rljob.io/v1alpha1`): spec and status types, defaults, validation, CRD.

Imported by both the operator and the runtime; it imports neither, nor torch, ray or kopf.
"""

GROUP = "rljob.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAME = "rlj"

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "SHORT_NAME", "SINGULAR", "VERSION"]
