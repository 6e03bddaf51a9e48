# `cmake --install`: headers, the library, zerotrainConfig.cmake (+ version) and zerotrain.pc.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS zerotrain EXPORT zerotrainTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/zerotrain DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/include/zerotrain/build_config.hpp
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/zerotrain)

set(ZT_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/zerotrain)
install(EXPORT zerotrainTargets NAMESPACE zerotrain:: DESTINATION ${ZT_CMAKE_DIR})
configure_package_config_file(cmake/zerotrainConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/zerotrainConfig.cmake INSTALL_DESTINATION ${ZT_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/zerotrainConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/zerotrainConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/zerotrainConfigVersion.cmake DESTINATION ${ZT_CMAKE_DIR})

# pkg-config: C++ consumers also need LibTorch's flags, which have no .pc of their own.
get_filename_component(ZT_TORCH_LIBDIR "${TORCH_LIBRARY}" DIRECTORY)
set(ZT_PC_TORCH_CFLAGS "")
foreach(_dir ${TORCH_INCLUDE_DIRS})
  string(APPEND ZT_PC_TORCH_CFLAGS " -I${_dir}")
endforeach()
string(APPEND ZT_PC_TORCH_CFLAGS " ${TORCH_CXX_FLAGS}")
set(ZT_PC_TORCH_LIBS "-L${ZT_TORCH_LIBDIR} -Wl,-rpath,${ZT_TORCH_LIBDIR} -ltorch -ltorch_cpu -lc10")
if(ZT_HAVE_TORCH_CUDA)
  string(APPEND ZT_PC_TORCH_LIBS " -ltorch_cuda -lc10_cuda")
endif()
# zerotrain.pc is the C API (what FFI hosts link); zerotrain-cxx.pc adds LibTorch for C++ users.
configure_file(cmake/zerotrain.pc.in ${CMAKE_CURRENT_BINARY_DIR}/zerotrain.pc @ONLY)
configure_file(cmake/zerotrain-cxx.pc.in ${CMAKE_CURRENT_BINARY_DIR}/zerotrain-cxx.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/zerotrain.pc ${CMAKE_CURRENT_BINARY_DIR}/zerotrain-cxx.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The same zerotrain.pc for this build tree (not installed): what the Go package's
# `#cgo pkg-config: zerotrain` finds in `make test` (tests/bindings/run_go.sh).
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/pkgconfig-build/zerotrain.pc
  "Name: zerotrain\nDescription: zerotrain's C API from the build tree ${PROJECT_BINARY_DIR}\n"
  "Version: ${PROJECT_VERSION}\n"
  "Cflags: -I${PROJECT_SOURCE_DIR}/include -I${PROJECT_BINARY_DIR}/include\n"
  "Libs: -L${PROJECT_BINARY_DIR}/lib -Wl,-rpath,${PROJECT_BINARY_DIR}/lib -lzerotrain\n")
