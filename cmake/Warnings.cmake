# Warnings for project code only (third-party headers come in as system includes).
function(zt_project_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  if(ZT_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()
