(function(){
  var panel=document.getElementById('details-panel'), current=null;
  function close(){
    if(current){var c=document.getElementById(current);if(c){c.classList.remove('selected');
      var d=document.getElementById(c.getAttribute('data-details'));if(d)d.hidden=true;}}
    current=null;panel.classList.remove('open');panel.setAttribute('data-open','');
    document.body.classList.remove('panel-open');
    if(location.hash.indexOf('#open=')===0)history.replaceState(null,'',location.pathname+location.search);
  }
  function open(id){
    var cell=document.getElementById(id);
    if(!cell||!cell.hasAttribute('data-details'))return false;
    var d=document.getElementById(cell.getAttribute('data-details'));
    if(!d)return false;
    if(current&&current!==id)close();
    current=id;d.hidden=false;cell.classList.add('selected');
    panel.classList.add('open');panel.setAttribute('data-open',id);panel.scrollTop=0;
    document.body.classList.add('panel-open');
    if(location.hash!=='#open='+id)history.replaceState(null,'','#open='+id);
    return true;
  }
  function fromHash(scroll){
    var k=/^#click=(.+)$/.exec(location.hash);
    if(k){var b=document.querySelector('#'+CSS.escape(decodeURIComponent(k[1]))+' button');if(b)b.click();return;}
    var m=/^#open=(.+)$/.exec(location.hash);
    if(m){var id=decodeURIComponent(m[1]);if(!open(id))close();
      if(scroll){var c=document.getElementById(id);if(c&&c.scrollIntoView)c.scrollIntoView({block:'nearest'});}}
  }
  document.addEventListener('click',function(ev){
    var t=ev.target;
    var copy=t.closest&&t.closest('button.copy');
    if(copy){var code=copy.closest('.replay').querySelector('code').textContent;
      if(navigator.clipboard)navigator.clipboard.writeText(code).then(function(){copy.textContent='copied';});
      return;}
    var cell=t.closest&&t.closest('td.cell[data-details]');
    if(cell){if(current===cell.id)close();else open(cell.id);return;}
    if(t.id==='panel-close')close();
  });
  document.addEventListener('keydown',function(ev){if(ev.key==='Escape')close();});
  document.getElementById('only-failing').addEventListener('change',function(ev){
    document.body.classList.toggle('only-failing',ev.target.checked);});
  window.addEventListener('hashchange',function(){fromHash(true);});
  fromHash(false);
})();
