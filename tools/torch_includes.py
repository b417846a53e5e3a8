"""Print the -I and -isystem flags that compile a torch extension source."""

import sysconfig

from torch.utils.cpp_extension import include_paths

flags = [f"-isystem {path}" for path in include_paths()]
flags.append(f"-isystem {sysconfig.get_paths()['include']}")
print(" ".join(flags))
