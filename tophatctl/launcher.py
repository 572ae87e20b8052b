"""The old home of the local mesh, kept while its importers move to the modules that now hold it.

    Mesh, MeshConfig, MeshStartError, mesh_model_dir   tophatctl/mesh.py, tophatctl/mesh_config.py
    find_port_base                                     tophatctl/mesh_ports.py
    REPO_ROOT, ServiceProcess                          tophatctl/service_process.py
"""

from __future__ import annotations

from tophatctl.mesh import Mesh
from tophatctl.mesh_config import MeshConfig, MeshStartError, mesh_model_dir
from tophatctl.mesh_ports import find_port_base
from tophatctl.service_process import REPO_ROOT, ServiceProcess

__all__ = ["Mesh", "MeshConfig", "MeshStartError", "REPO_ROOT", "ServiceProcess", "find_port_base", "mesh_model_dir"]
